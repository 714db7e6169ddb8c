"""``push_to_hub``: one commit with the weights and the card, on ``huggingface_hub``'s own upload and retry machinery.

``HfApi.preupload_lfs_files`` uploads the files, retrying transient HTTP errors and dropped connections with
``http_backoff``; ``HfApi.create_commit`` sends the one atomic commit. What ``huggingface_hub`` deliberately leaves
out is a retry of the commit request itself, since an answer lost after the server applied the commit would make a
retry commit twice. This module adds exactly that: the commit names its parent, and a retry first checks whether the
previous attempt landed. Every other failure (offline mode, HTTP 401/403/404, invalid metadata) stops the push at once
with a [`HubPushError`] naming the step and the HTTP status.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from .card import _method_of, render_model_card
from ..errors import UsageError
from .staging import (
    PUSH_MODES,
    README_NAME,
    HubPushError,
    _collect_files,
    _looks_local,
    _point_adapter_config_at_hub,
    _resolve_hub_base_model,
    _stage,
    _validate_staged,
    local_base_refusal,
)
from .summary import TrainingSummary

logger = logging.getLogger(__name__)


COMMIT_STAGE = "creating the commit"


# HTTP statuses that end a push at once, with what they mean for it
STATUS_EXPLANATIONS = {
    401: ("authentication failed", "the token is invalid, expired or missing. Pass a valid write token (token=..., "
                                   "HF_TOKEN, or `hf auth login`)."),
    403: ("the Hub refused the write", "the token has no write access to this namespace, or the repository is "
                                       "read-only."),
    404: ("not found", "the repository or branch does not exist or is not visible with this token."),
    412: ("the branch moved", "another commit landed first; nothing was committed by this push. Push again."),
}


# ----------------------------------------------------------------------------------------------------------------------
# Errors: huggingface_hub's classification, our messages
# ----------------------------------------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes: huggingface_hub wraps upload errors (e.g. in ``RuntimeError``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status_of(exc: BaseException) -> Optional[int]:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


def _transient_cause(exc: BaseException) -> Optional[str]:
    """``"HTTP 503"`` or ``"ConnectError: ..."`` when ``huggingface_hub``'s ``http_backoff`` retries ``exc`` by default
    (its own policy, read from its signature); ``None`` for everything else, e.g. offline mode or HTTP 401."""
    from huggingface_hub.utils import http_backoff

    policy = inspect.signature(http_backoff).parameters
    status = _status_of(exc)
    if status is not None:
        return f"HTTP {status}" if status in policy["retry_on_status_codes"].default else None
    retried = policy["retry_on_exceptions"].default
    return next((f"{type(e).__name__}: {e}" for e in _chain(exc) if isinstance(e, retried)), None)


class _Redactor:
    """Replaces the token with ``***`` in any text that could reach the user."""

    def __init__(self, token: Optional[str]) -> None:
        self.token = token if isinstance(token, str) and token else None

    def __call__(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text


def _push_error(exc: BaseException, stage: str, where: str, redact: _Redactor,
                attempts: Optional[int] = 1) -> HubPushError:
    """A [`HubPushError`] for ``exc``; ``attempts=None`` for a step that huggingface_hub itself retried."""
    status = _status_of(exc)
    said = next((str(e.server_message).strip() for e in _chain(exc) if getattr(e, "server_message", None)), "")
    said = f" The server said: {said}" if said else ""
    transient = _transient_cause(exc)
    if isinstance(exc, ValueError) and "Invalid metadata in README.md" in str(exc):
        message = f"the Hub rejected the model card metadata while {stage} for {where}: {exc}"
    elif status in STATUS_EXPLANATIONS:
        what, why = STATUS_EXPLANATIONS[status]
        message = f"{what} (HTTP {status}) while {stage} for {where}: {why}{said}"
    elif transient:
        tries = f"after {attempts} attempt(s)" if attempts else "after huggingface_hub's own retries"
        message = (f"{stage} for {where} failed {tries} with transient errors ({transient}). A push is a single "
                   "commit: unless the last request reached the server, the repository was left as it was. Push "
                   "again when the Hub is reachable.")
    else:
        message = f"{stage} for {where} failed: {type(exc).__name__}: {exc}"
    return HubPushError(redact(message), stage=stage, status=status)


# ----------------------------------------------------------------------------------------------------------------------
# Upload: huggingface_hub uploads; the commit is retried here, never twice
# ----------------------------------------------------------------------------------------------------------------------
def _landed_commit(api, repo_id: str, branch: str, parent: str, message: str):
    """The commit of a previous attempt when it reached the branch (its answer was lost), else ``None``."""
    from huggingface_hub import CommitInfo

    head = api.repo_info(repo_id, revision=branch).sha
    if head == parent:
        return None
    commits = api.list_repo_commits(repo_id, revision=branch)
    if len(commits) >= 2 and commits[0].title == message and commits[1].commit_id == parent:
        logger.warning("The previous attempt's commit %s reached %s before the connection dropped; not committing "
                       "twice.", head, repo_id)
        return CommitInfo(commit_url=f"{api.endpoint}/{repo_id}/commit/{head}", commit_message=message,
                          commit_description="", oid=head, _endpoint=api.endpoint)
    raise HubPushError(f"branch {branch!r} of {repo_id} moved to {head} during the push (another writer?); this push "
                       "committed nothing. Push again.", stage=COMMIT_STAGE)


def _upload(api, repo_id: str, folder: str, files: list[str], message: str, private: Optional[bool],
            revision: Optional[str], max_retries: int, retry_base_wait: float, redact: _Redactor):
    from huggingface_hub import CommitOperationAdd

    where = f"{repo_id} on {api.endpoint}"

    def step(stage: str, call, attempts: Optional[int] = 1):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - re-raised as HubPushError naming the step and the status
            raise _push_error(exc, stage, where, redact, attempts) from exc

    step("creating the repository", lambda: api.create_repo(repo_id, private=private, exist_ok=True))
    branch = revision or "main"
    if branch != "main":
        step(f"creating branch {branch!r}", lambda: api.create_branch(repo_id, branch=branch, exist_ok=True))
    parent = step(f"reading the head of {branch!r}", lambda: api.repo_info(repo_id, revision=branch).sha)
    operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=os.path.join(folder, p)) for p in files]
    logger.info("Pushing %d files to %s (branch %s) in one commit: %s", len(files), repo_id, branch, ", ".join(files))
    # huggingface_hub's http_backoff retries these uploads; create_commit below does not upload them again
    step("uploading the files", lambda: api.preupload_lfs_files(repo_id, additions=operations, revision=branch,
                                                                 free_memory=False), attempts=None)
    for attempt in range(max_retries + 1):
        try:
            if attempt:  # a dropped connection can hide a commit that the server applied: look before committing
                landed = _landed_commit(api, repo_id, branch, parent, message)
                if landed is not None:
                    return landed
            return api.create_commit(repo_id, operations=operations, commit_message=message, revision=branch,
                                     parent_commit=parent)
        except HubPushError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried when huggingface_hub would retry it, else re-raised
            cause = _transient_cause(exc)
            if cause is None or attempt == max_retries:
                raise _push_error(exc, COMMIT_STAGE, where, redact, attempt + 1) from exc
            wait = min(retry_base_wait * 2**attempt, 30.0)
            logger.warning("%s for %s hit a transient error (%s); retrying in %.1fs (attempt %d of %d).",
                           COMMIT_STAGE, repo_id, redact(cause), wait, attempt + 2, max_retries + 1)
            time.sleep(wait)


@dataclass
class PushPlan:
    """What ``push_to_hub(..., dry_run=True)`` would upload: ``files`` as ``(name, bytes)``, the card's text."""

    repo_id: str
    mode: str
    message: str
    card: str
    files: list

    def format(self) -> str:
        lines = [f"dry run: nothing was uploaded. A push would make one commit to {self.repo_id} ({self.mode}), "
                 f"{self.message!r}, with {len(self.files)} file(s):"]
        lines += [f"  {name}  ({size / 2**20:.2f} MiB)" if size >= 2**20 else f"  {name}  ({size} B)"
                  for name, size in self.files]
        return "\n".join(lines + ["", "README.md (the model card):", "", self.card])


def _inherit_license(api, hub_base: Optional[str]) -> Optional[str]:
    """The base model's license from its Hub card, best effort: a card without one is still a valid card. ``api``
    ``None`` (a dry run): no request, no license."""
    if not hub_base or api is None:
        return None
    try:
        data = api.model_info(hub_base, timeout=10).card_data
    except Exception as exc:  # noqa: BLE001 - offline, private or missing base: just no license
        logger.info("Could not read the license of %s (%s); the card has none unless given.", hub_base,
                    type(exc).__name__)
        return None
    license_ = data.get("license") if data is not None else None
    return license_ if isinstance(license_, str) else None


# ----------------------------------------------------------------------------------------------------------------------
# The steps of a push
# ----------------------------------------------------------------------------------------------------------------------
def _check_push_args(repo_id: str, mode: Optional[str], max_retries: int, retry_base_wait: float) -> None:
    """Refuse an invalid mode, repo id or retry setting before anything is built."""
    from huggingface_hub.utils import validate_repo_id

    if mode is not None and mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES} (or None to choose from the input).")
    validate_repo_id(repo_id)
    if "/" not in repo_id:
        raise ValueError(f"repo_id={repo_id!r} is invalid; expected 'namespace/name'.")
    if max_retries < 0 or retry_base_wait < 0:
        raise ValueError(f"max_retries={max_retries} and retry_base_wait={retry_base_wait} must be >= 0.")


def check_push_base(model_args, lisa_args) -> None:
    """``hf-lisa train --push_to_hub`` of an adapter whose base model is a local folder needs ``--base_model_id``:
    refused when the arguments are checked, before training, as the push itself would refuse it after training.

    Raises:
        UsageError: naming the folder and ``--base_model_id``.
    """
    from ..methods import get_method
    from ..models import is_default_model

    adapter = get_method(lisa_args.method).is_adapter
    if (lisa_args.push_mode or ("adapter" if adapter else "merged")) != "adapter":
        return
    path = model_args.model_name_or_path
    base = model_args.base_model_id or (None if path is None or is_default_model(path) else path)
    if base and _looks_local(base):
        raise UsageError(f"--push_to_hub: {local_base_refusal(base, '--base_model_id namespace/name')} Or push "
                         "merged weights: --push_mode merged. Nothing was trained.")


def _stage_for_hub(model_or_dir, mode: Optional[str], folder: str, tokenizer, max_shard_size: Union[int, str],
                   base_model: Optional[str], training_summary, card_data: Optional[dict]):
    """Stage the weights in ``folder`` and resolve the base model's Hub id: ``(staged, hub_base)``."""
    staged = _stage(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model, training_summary)
    hub_base = _resolve_hub_base_model(base_model, (card_data or {}).get("base_model"), staged.summary.base_model,
                                       staged.source_base)
    if staged.mode == "adapter":
        _point_adapter_config_at_hub(staged, hub_base)
    return staged, hub_base


def _card_for(api, repo_id: str, staged, hub_base: Optional[str], card, card_data: Optional[dict]):
    """The card to upload: rendered from the staged files, or the caller's card with a missing license filled in."""
    from huggingface_hub import ModelCard

    if card is None:
        license_ = None
        if not (card_data or {}).get("license") and not staged.summary.license:
            license_ = _inherit_license(api, hub_base)
        return render_model_card(
            repo_id, staged.mode, base_model=hub_base, adapter_config=staged.adapter_config,
            model_config=staged.model_config, summary=staged.summary, card_data=card_data,
            loss_plot=staged.loss_plot, license=license_,
        )
    if not card.data.license and (license_ := _inherit_license(api, hub_base)):
        card = ModelCard(card.content)  # a copy: the caller's card stays as it was
        card.data.license = license_
    return card


def _commit_message(commit_message: Optional[str], staged) -> str:
    """The given commit message, else "Upload adapter (hf-lisa, <method>)" / "Upload merged weights (...)"."""
    method = _method_of(staged.mode, staged.adapter_config, staged.summary)
    return commit_message or (
        f"Upload adapter (hf-lisa, {method})" if staged.mode == "adapter"
        else f"Upload merged weights (hf-lisa, {method})"
    )


def push_to_hub(
    model_or_dir,
    repo_id: str,
    mode: Optional[str] = None,
    private: Optional[bool] = None,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    token: Optional[str] = None,
    card_data: Optional[dict] = None,
    base_model: Optional[str] = None,
    tokenizer=None,
    *,
    training_summary: Optional[Union[TrainingSummary, dict]] = None,
    card=None,
    max_shard_size: Union[int, str] = "5GB",
    endpoint: Optional[str] = None,
    max_retries: int = 3,
    retry_base_wait: float = 1.0,
    dry_run: bool = False,
):
    """Push a LISA adapter or merged model to the Hub as one commit with a complete model card.

    ``mode="adapter"`` uploads ``adapter_config.json`` and ``adapter_model.safetensors`` (factors, masks and
    interpolation scalars), the card, the loss plot and the tokenizer files when present. ``mode="merged"`` folds
    ``ΔW = s · M ⊙ (B A)`` into the base weights and uploads sharded safetensors with ``config.json``,
    ``generation_config.json`` and the tokenizer; adapters with layer interpolation cannot be merged and raise
    ``ValueError``. Full-parameter LISA output (a plain transformers model or its directory) is pushed as merged.

    Everything is built in a temporary folder and checked first, then uploaded through ``huggingface_hub``
    (``preupload_lfs_files``, whose ``http_backoff`` retries transient errors) and committed by a single
    ``create_commit``: a failure leaves the repo as it was. The commit is retried on transient errors, without ever
    committing twice. Pickle files (``*.bin``, ``*.pt``, ``training_args.bin``, …) are never uploaded, nor anything
    behind a symbolic link that leads out of the output directory (a warning names each such link).

    Args:
        model_or_dir: a ``peft.PeftModel``, a ``transformers.PreTrainedModel`` (full-parameter LISA), or a training
            output directory. A directory may hold ``training_summary.json`` (method, LISA settings,
            hyperparameters, metrics, datasets, loss plot, license, the base model's Hub id) for the card.
        repo_id: ``"namespace/name"``; created if missing.
        mode: ``"adapter"`` or ``"merged"``; by default adapters are pushed as adapters and full weights as merged.
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to push to, created from ``main`` if missing.
        commit_message: defaults to "Upload adapter (hf-lisa, <method>)" / "Upload merged weights (...)".
        token: a write token; defaults to ``HF_TOKEN`` or the saved login. Never printed or logged.
        card_data: metadata overrides for the card, e.g. ``{"language": "en", "license": "mit"}``.
        base_model: Hub id of the base model, for the card and for the uploaded adapter config when training
            recorded a local path. An adapter whose base is a local folder is refused without it (unless the
            training summary or ``card_data`` names the Hub id), since nobody could load it from the Hub.
        tokenizer: a tokenizer to upload with the model.
        training_summary: the training summary. A [`TrainingSummary`] is used as given (a directory's
            ``training_summary.json`` is then not read); a dict is laid over the directory's file, if any.
        card: an already rendered ``huggingface_hub.ModelCard`` for this repo and mode (e.g. the one
            ``hf-lisa train`` wrote), uploaded as ``README.md`` instead of rendering one; ``card_data`` does not
            apply to it, and only a missing license is filled in from the base model's Hub card.
        max_shard_size: largest safetensors shard of merged weights.
        endpoint: the Hub endpoint; ``HF_ENDPOINT`` by default.
        max_retries: retries of the commit on the transient errors ``huggingface_hub`` retries (5xx, 429, dropped
            connections); the file uploads are retried by ``huggingface_hub`` itself.
        retry_base_wait: first wait before a commit retry, in seconds; doubles at each retry, capped at 30 s.
        dry_run: build, check and render everything a push would upload, and return it instead of uploading: no
            request is made (so no license is read from the base model's Hub card).

    Returns:
        `huggingface_hub.CommitInfo`: the URL of the commit (a ``str``), with ``.oid``; with ``dry_run``, a
        :class:`PushPlan` (the files with their sizes, the card's text, the commit message).

    Raises:
        HubPushError: the Hub refused or failed the push (the message names the step and the HTTP status).
        UsageError: (a ``ValueError``) before any upload: an adapter whose base model is a local folder without a
            known Hub id, a weight or config file that is a symbolic link out of the output directory, or full
            weights only as pickle (``pytorch_model.bin``, named; never unpickled).
        ValueError: invalid arguments, or an adapter that cannot be merged.

    Example:
        ```py
        >>> import hf_lisa
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa")  # doctest: +SKIP
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa-merged", mode="merged")  # doctest: +SKIP
        ```
    """
    from huggingface_hub import HfApi, get_token

    _check_push_args(repo_id, mode, max_retries, retry_base_wait)
    with tempfile.TemporaryDirectory(prefix="hf-lisa-push-") as folder:
        staged, hub_base = _stage_for_hub(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model,
                                          training_summary, card_data)
        api = None if dry_run else HfApi(endpoint=endpoint, token=token)
        card = _card_for(api, repo_id, staged, hub_base, card, card_data)
        card.save(os.path.join(folder, README_NAME))
        files = _collect_files(folder, staged.mode, staged.loss_plot)
        _validate_staged(staged, files)
        message = _commit_message(commit_message, staged)
        if dry_run:
            return PushPlan(repo_id=repo_id, mode=staged.mode, message=message, card=str(card),
                            files=[(name, os.path.getsize(os.path.join(folder, name))) for name in sorted(files)])
        info = _upload(api, repo_id, folder, files, message, private, revision, max_retries, retry_base_wait,
                       _Redactor(token or get_token()))
    logger.info("Pushed %s to %s: %s", staged.mode, repo_id, info)
    return info
